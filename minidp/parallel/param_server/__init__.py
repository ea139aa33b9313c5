"""The parameter server (ps-lite): messages.py (tagged headers and payloads), server.py (one
server's shard, optimizer and BSP / ASP / SSP clocks), pieces.py (ParameterServerWorker
around a user's model, and serve(), a server's loop).
"""
