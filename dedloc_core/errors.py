"""The exception tree. Each error has a short ``title`` and a ``message`` a person can act on.

    DedlocError
     ├── CatalogError      a catalog that is unsigned, tampered, expired, malformed, ...
     ├── ShardError        a data shard that cannot be fetched or verified
     ├── ProtocolError     a malformed message between app and worker
     ├── RecipeError       unknown recipe or bad recipe parameters
     └── WorkerError       the worker failed (training, swarm, resources)
"""


class DedlocError(Exception):
    title = "Error"

    def __init__(self, message: str, *, title: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        if title is not None:
            self.title = title
        self.code = code or type(self).__name__

    def __str__(self) -> str:
        return self.message


class CatalogError(DedlocError):
    title = "Catalog rejected"


class ShardError(DedlocError):
    title = "Training data unavailable"


class ProtocolError(DedlocError):
    title = "Protocol error"


class RecipeError(DedlocError):
    title = "Unknown or invalid recipe"


class WorkerError(DedlocError):
    title = "Training stopped"
