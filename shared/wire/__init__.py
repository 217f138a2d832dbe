"""The wire between processes: message format (protocol), ZeroMQ transport, CURVE keys, a stage's /info (StageInfo), and the gateway's client of the pipeline."""
