"""Adapters to the libraries users already train with. Each is imported on its own
(``hyper_parallel.integrations.transformers``) and imports its library lazily; core never
imports them."""
