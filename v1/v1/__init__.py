"""vLLM's `vllm.v1.*` module paths: importing this package installs
`v1.compat.vllm_v1`'s finder, which makes `v1.v1.<path>` the module `v1.<path>`."""

from v1.compat import vllm_v1

vllm_v1.install()
