"""The image store's error: one line naming the image and, where there is one, the layer."""
from agent.errors import DsecError, EXIT_USAGE


class ImageError(DsecError):
    """Bad image input or a store failure; code 2 (bad input) unless a failure of ours says 1."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message, code)


class ImageNotFound(ImageError):
    """No image of that name, tag or digest in the node's store."""
