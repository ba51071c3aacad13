"""Decode node: prealloc and transfer queues, continuous batching, retraction."""
