"""KV transfer: backend interface, NIXL and fake backends, KVSender/KVReceiver."""
