"""The bench kit: what every benchmark shares: results.py (card, percentiles, result files, tables),
service.py (the service started), client.py (a timed streamed chat) and stage.py (paths, staging)."""
