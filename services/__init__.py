"""moe-cluster: serve DeepSeek-V3-architecture MoE models with attention and experts disaggregated."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("moe-cluster")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"
