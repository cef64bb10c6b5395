"""The stream worker: the faust application and its shell around the pure core (the agents,
the cursor that repairs skipped messages, the transport, Kafka security, and the charge fold's
confluent-kafka consumer). Nothing here computes a figure; ``nodeshare.streams.core`` does."""
