"""Block backends (see ``base``); ``get_backend(name, ...)`` resolves a name or ``"auto"``."""
