"""The errors of a bad config: every message names the key and, where known, the file and line or the override."""


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and its origin."""


class ConfigPathError(ConfigError, FileNotFoundError):
    """A file or folder the config names does not exist (an OSError too, for callers that catch those)."""
