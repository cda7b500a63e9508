"""Disaggregated prefill and decode: the KV handoff between an `inferd serve --role prefill` and a
`--role decode` process (docs/disaggregation.md).

- `settings`: one instance's side of the handoff (role, secret, channel or allow-list), checked before a load;
- `params`: the transfer parameters a prefill instance hands out, signed with the shared secret;
- `leases`: the prefill side's table of pinned blocks (id, epoch, expiry, checksums);
- `transport`: KV bytes in and out of the paged cache, shared memory and the authenticated TCP channel;
- `proxy`: the OpenAI-compatible front that sends a request to a prefill and then a decode instance.

The engine's connector (`inferd.engine.kv_connector`) puts these together; nothing here imports the engine.
"""
