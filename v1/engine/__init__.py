"""The engine: processor, output processor, engine core and its clients (docs/architecture.md).

Importing it loads torch under OpenMP's passive wait policy, leaving the environment as it
was (`v1.engine.openmp`): every engine, in process or forked, runs its OpenMP threads so.
"""

from v1.engine.openmp import load_torch_passively

load_torch_passively()
