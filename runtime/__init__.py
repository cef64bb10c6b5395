"""The ground every shell stands on: the settings (``config``), logging (``logs``), Prometheus
metrics (``metrics``) and the consumer loop that commits only after a durable write
(``consumer``). It imports nothing of the domain's shells and nothing of the command line."""
