"""`v1 demo`: batched answers to questions under one shared system prompt."""

import argparse
import time

from v1.entrypoints.llm import LLM
from v1.sampling_params import SamplingParams

SYSTEM_PROMPT = (
    "You are the help desk of the Riverside public library. Answer in one or two short "
    "sentences, only from these facts. Opening hours: Monday to Friday 9:00 to 20:00, "
    "Saturday 10:00 to 16:00, closed on Sunday and public holidays. A library card is free "
    "for residents and costs 15 euros a year for others. Books are lent for three weeks, "
    "films and games for one week. A loan can be renewed twice online or at the desk unless "
    "someone has reserved the item. Late fees are 20 cents a day per item, capped at 5 euros "
    "per item. Study rooms hold up to six people and can be booked online for two hours a "
    "day. Printing costs 10 cents a page in black and white and 50 cents in colour. The "
    "children's corner has story time every Wednesday at 16:00. Wi-Fi is free; the network "
    "is called Riverside-Guest and needs no password."
)

QUESTIONS = [
    "When are you open on Saturday?",
    "How long can I borrow a film?",
    "What does a library card cost if I don't live here?",
    "How much is the late fee for a book that is ten days late?",
    "Can I renew a book that someone else has reserved?",
    "How many people fit in a study room?",
    "What does a colour print cost?",
    "When is story time for children?",
    "What is the Wi-Fi network called?",
    "Are you open on Sundays?",
    "How many times can I renew a loan?",
    "Is the library card free for residents?",
]


def main(argv: list[str] | None = None, prog: str = "v1 demo") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("--model", default=None, help="GGUF file or HF directory")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    llm = LLM(args.model, max_model_len=2048)
    tokenizer = llm.get_tokenizer()
    conversations = [
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
        for q in QUESTIONS
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    elapsed = time.perf_counter() - start

    for question, out in zip(QUESTIONS, outputs):
        print(f"\nQ: {question}\nA: {out.outputs[0].text.strip()}")
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_cached = sum(o.num_cached_tokens for o in outputs)
    stats = llm.get_stats()
    system_len = len(tokenizer.encode(SYSTEM_PROMPT))
    print(
        f"\n{len(outputs)} requests, shared system prompt of {system_len} tokens\n"
        f"prompt tokens: {num_prompt} ({num_cached} served from the prefix cache)\n"
        f"output tokens: {num_out} in {elapsed:.2f} s: {num_out / elapsed:.1f} tokens/s, "
        f"{(num_prompt + num_out) / elapsed:.1f} total tokens/s\n"
        f"prefix-cache hit rate: {stats.prefix_cache_hit_rate:.1%}, "
        f"preemptions: {stats.num_preemptions}"
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
