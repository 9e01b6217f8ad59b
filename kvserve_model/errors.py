"""The one error of this package: a model that cannot be found, read or loaded."""


class ModelLoadError(Exception):
    """A model name or path could not be resolved or loaded; the message says which and why.

    The worker's startup reports it as the model's failure (``kvserve_launch.startup``'s
    ``ModelUnavailable``), and so does the gateway's."""
