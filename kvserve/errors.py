"""The error every layer raises for a user-facing configuration problem. Its own module, on the
package's lowest floor, so that any module can raise it without importing what configures it."""
from __future__ import annotations


class ConfigError(ValueError):
    """A user-facing configuration problem (bad model path, bad engine argument...)."""
