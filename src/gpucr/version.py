"""The package's version, apart from its __init__: modules below the public API (the wire's code identity, the
CLI) read it without importing the whole package."""
__version__ = "0.1.0"   # as pyproject.toml says
