"""The prefix cache's block keys: one chained hash, shared by the engine and anything that predicts its hits.

Every full block of `block_size` tokens is keyed by sha256(parent key, its token ids, and the
request's `cache_salt` in the first block only), so a key names the block's whole prefix and two
tenants with different salts never share a block. The gateway's prefix-affinity index hashes with these
same functions, so what it predicts is what the engine's cache holds. Plain hashlib: stable across
processes and machines, unlike `hash()`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

HASH_ROOT = b"inferd-prefix-root"  # the first block's parent
# how a key is computed, as the KV events name it: sha256(parent key or HASH_ROOT, token ids as int64
# little-endian, then b"\x00salt:" + salt in the first block only)
HASH_SCHEME = "sha256-chain-int64le"


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], salt: str | None = None) -> BlockHash:
    """The key of one block: sha256 over (parent key, token ids as little-endian int64, salt).

    A token id that is no int64 (a float, a string, an int past 64 bits) is a ValueError naming it."""
    h = hashlib.sha256(parent or HASH_ROOT)
    try:
        h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    except struct.error:
        bad = next((t for t in token_ids if not _is_int64(t)), None)
        raise ValueError(f"token ids are integers in [-2**63, 2**63), not {bad!r}") from None
    if salt:
        h.update(b"\x00salt:" + salt.encode("utf-8", "surrogatepass"))
    return h.digest()


def _is_int64(t: object) -> bool:
    try:
        struct.pack("<q", t)
    except struct.error:
        return False
    return True


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, salt: str | None = None
) -> list[BlockHash]:
    """Extend `hashes` (in place, and return it) to cover every full block of `token_ids`."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        # the salt goes into the first block only: the chain carries it to every later block
        hashes.append(
            hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], salt if i == 0 else None)
        )
    return hashes


def adapter_salt(salt: str | None, adapter: str | None) -> str | None:
    """The salt of a request run under a LoRA adapter: its cache_salt and the adapter, so blocks computed under
    one adapter (or none) never share keys with another's. The engine names an adapter by its name and weights
    digest, the gateway and the Ray ingress (which know no digest) by its name."""
    return salt if adapter is None else f"{salt or ''}\x00lora:{adapter}"


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[BlockHash]:
    """The keys of every full block of a prompt."""
    return extend_block_hashes([], token_ids, block_size, salt)
