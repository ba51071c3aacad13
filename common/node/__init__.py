"""The node runtime both node roles share.

The process frame, its HTTP side, the registry link, the gateway watch.
"""
