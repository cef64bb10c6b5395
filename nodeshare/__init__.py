"""nodeshare: fair, measured and safe node sharing for HPC clusters."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("nodeshare")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
