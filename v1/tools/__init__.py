"""Tools run as modules: `python -m v1.tools.gpu_check` (issue 14 §7) and `v1.tools.wheels`."""
