"""Moving versioned weights from the trainer to the engines: shared memory, broadcast, files."""

from asyncrl.weight_sync.base import SyncStats, WeightLayout, WeightReceiver, WeightSender, WeightSyncError

__all__ = ["SyncStats", "WeightLayout", "WeightReceiver", "WeightSender", "WeightSyncError"]
