"""Connectors between inference engines and tierd (installed as `tierd.connectors`)."""
