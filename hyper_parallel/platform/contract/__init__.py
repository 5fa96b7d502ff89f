"""The platform contract, one section per module.

`hyper_parallel.platform.base.Platform` composes these sections into one ABC. Every
member is an ``@abstractmethod``: a backend that misses one cannot be constructed.
"""
