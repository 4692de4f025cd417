"""Scheduling policy: requests and their states, the block manager, admission, the
scheduler, beam bookkeeping, stop rules and KV sizing. Pure Python: nothing here imports
torch, so all of it is unit-tested with fake sizes on any machine."""
