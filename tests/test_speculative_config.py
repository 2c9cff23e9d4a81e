"""speculative_config: vLLM's keys and defaults, and a clear ValueError for anything else,
through EngineArgs, LLM and `serve --speculative-config`."""

import pytest

from v1.config import EngineArgs, SpeculativeConfig
from v1.config.speculative import DEFAULT_SUFFIX_MAX_CACHED_TOKENS
from v1.entrypoints.openai.api_server import make_parser
from v1.worker.spec_decode.proposer import make_proposer


def test_ngram_defaults_as_vllm():
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    spec = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 4)
    suffix = SpeculativeConfig.from_dict({"method": "suffix"})
    assert suffix.num_speculative_tokens == suffix.suffix_decoding_max_tree_depth == 24
    # v1's own key (vLLM bounds the shared tree by requests only) reaches the proposer.
    assert make_proposer(suffix).max_cached_tokens == DEFAULT_SUFFIX_MAX_CACHED_TOKENS
    capped = {"method": "suffix", "suffix_decoding_max_cached_tokens": 5000}
    assert make_proposer(SpeculativeConfig.from_dict(capped)).max_cached_tokens == 5000
    args = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert args.speculative() == SpeculativeConfig("ngram", 2, 5, 5)
    assert EngineArgs().speculative() is None


@pytest.mark.parametrize(
    "config, match",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens .* \[1, 64\]"),
        ({"method": "ngram", "num_speculative_tokens": 65}, r"\[1, 64\], got 65"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "must be an integer"),
        ({"method": "ngram", "num_speculative_tokens": 2, "foo": 1}, r"unknown .*\['foo'\]"),
        ({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 4},
         "unknown speculative_config keys"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
         "prompt_lookup_min must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
          "prompt_lookup_max": 2}, r"prompt_lookup_min \(4\) must be <= prompt_lookup_max"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "min_token_prob"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "max_spec_factor"),
        ({"method": "suffix", "suffix_decoding_max_cached_tokens": -1},
         "max_cached_tokens must be an integer >= 0"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": float("inf")}, "finite"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": float("nan")}, "finite"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": float("nan")}, "min_token_prob"),
        ({"method": "suffix", "num_speculative_tokens": 4,
          "suffix_decoding_max_tree_depth": 3_000_000}, r"\[1, 256\]"),
        ("ngram", "must be a dict"),
    ],
)
def test_bad_configs_are_value_errors(config, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(speculative_config=config)


def test_cli_takes_json():
    parser = make_parser()
    args = parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
    )
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "[4]"])


def test_a_config_built_directly_is_checked_too():
    """EngineArgs(speculative_config=SpeculativeConfig(...)) goes through the same checks as
    a dict (it used to skip them all)."""
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer"):
        EngineArgs(speculative_config=SpeculativeConfig("ngram", 0))
    with pytest.raises(ValueError, match="method must be one of"):
        EngineArgs(speculative_config=SpeculativeConfig("eagle", 2))
    spec = EngineArgs(speculative_config=SpeculativeConfig("ngram", 2)).speculative()
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)  # vLLM's defaults
