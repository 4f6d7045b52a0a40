"""trainbench: MLPerf-Training-style benchmarks end to end."""

__version__ = "0.1.0"
