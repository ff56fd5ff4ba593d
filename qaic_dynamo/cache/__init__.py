"""The cache stage: artifacts by fingerprint, in memory for this process (:mod:`.memory`),
then on disk across processes (:mod:`.disk`).

:data:`artifact_cache` is the process's one cache; the backend asks it for a piece's key
with :meth:`CompileCache.get_or_compile` and says how to compile a miss. The cache never
imports the lowering: it only knows that a compile may raise a ``CompileError``.
"""

from qaic_dynamo.cache.disk import STALE_TMP_SECONDS, DiskCache, EntryInfo
from qaic_dynamo.cache.memory import CacheResult, CompileCache, Source, artifact_cache

__all__ = ["STALE_TMP_SECONDS", "CacheResult", "CompileCache", "DiskCache", "EntryInfo", "Source", "artifact_cache"]
