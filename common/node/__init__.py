"""The node runtime both node roles share: the process frame, its HTTP side, the registry link, the gateway watch."""
