"""Module `__getattr__` for the stand-in: any name a module asks for exists, and raises when it is used."""


def getattr_for(module: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{module}.{name}: torchvision is a stand-in in this SGLang CPU server (image models "
                               "are not served here)")

        unavailable.__name__ = name
        return unavailable

    return __getattr__
