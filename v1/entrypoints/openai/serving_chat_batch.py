"""vLLM's /v1/chat/completions/batch: several conversations in one request, each answered as
a chat completion of its own (all in flight at once, batched by the scheduler), merged into
one response whose choice i answers conversation i and whose usage is their sum."""

import asyncio
import time
import uuid

from v1.entrypoints.openai.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionResponse,
    PromptTokensDetails,
    UsageInfo,
)
from v1.entrypoints.openai.serving import OpenAIServing


async def create_batch_chat_completion(
    serving: OpenAIServing, request: BatchChatCompletionRequest
) -> ChatCompletionResponse:
    # Each conversation is a prompt and (n is 1) a sequence: both limits hold.
    limits = serving.limits
    limit, name = min((limits.max_completion_prompts, "max_completion_prompts"),
                      (limits.max_request_sequences, "max_request_sequences"))
    if len(request.messages) > limit:
        raise ValueError(
            f"the request has {len(request.messages)} conversations, more than {name} ({limit})"
        )
    tasks = [asyncio.ensure_future(serving.create_chat_completion(single))
             for single in await serving.engine.run_in_pool(request.conversations)]
    try:
        responses = list(await asyncio.gather(*tasks))
    finally:  # one failed, or the client left: the others end too (aborted in the engine)
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
    choices = []
    for i, response in enumerate(responses):
        assert isinstance(response, ChatCompletionResponse)  # not streamed
        choices += [choice.model_copy(update={"index": i}) for choice in response.choices]
    usages = [response.usage for response in responses]
    return ChatCompletionResponse(
        id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=responses[0].model,
        choices=choices,
        usage=UsageInfo(
            prompt_tokens=sum(u.prompt_tokens for u in usages),
            completion_tokens=sum(u.completion_tokens for u in usages),
            total_tokens=sum(u.total_tokens for u in usages),
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(u.prompt_tokens_details.cached_tokens for u in usages)
            ),
        ),
    )
