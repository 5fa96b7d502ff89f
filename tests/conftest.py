pytest_plugins = ["hyper_parallel.testing.pytest_plugin"]
