"""The stage worker: one asyncio loop per process (receive / compute thread / send overlap) plus HTTP probes."""
