"""A click-through-rate benchmark from outside trainbench's tree: a DLRM-shaped model (embedding tables, a bottom
MLP for the dense features, their pairwise dot products, a top MLP) trained to an AUC target on synthetic clicks.

``pyproject.toml`` declares :class:`CtrBenchmark` under the ``trainbench.benchmarks`` entry points; docs/extending.md
("A family of your own") walks through each part.
"""

from trainbench_ctr.benchmark import CtrBenchmark

__all__ = ["CtrBenchmark"]
