"""What writes events: the cluster simulator and the Kafka producer wrapper."""
