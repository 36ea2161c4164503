"""Errors a user can cause. Each message says what was wrong and what to do."""


class TrtspecError(Exception):
    """Base class of every error trtspec raises on bad input."""


class UnsupportedModelError(TrtspecError, ValueError):
    """The model's architecture or configuration cannot be exported."""


class ArtifactError(TrtspecError):
    """An export/ or engines/ directory is missing, corrupt, foreign, or for another backend."""


class CapacityError(TrtspecError, ValueError):
    """A call asks for more batch rows or cache slots than the engine was built with."""


class BackendUnavailableError(TrtspecError, RuntimeError):
    """The requested backend cannot run on this machine."""


class EngineBusyError(TrtspecError, RuntimeError):
    """An engine was called from a second thread while another call was running on it."""


class AddressInUseError(TrtspecError, OSError):
    """The server cannot listen on the host and port asked for (taken by another process, or not this machine's)."""
