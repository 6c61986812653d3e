"""The weight sync's forms, one class each behind one interface (base.Publisher):

    directory.py  full HF directories in publish_dir (the portable form)
    delta.py      sparse deltas against the previous publish, rebuilt by the workers from the chain
    slot.py       a ring of shared-memory slots on this host, a directory now and then beside it
    adapter.py    a LoRA adapter alone, applied by the workers to the base they hold

weights.sync chooses one per run; the mechanics live beside this package (publish, deltas,
slots, adapters), so a form is what it writes, when, and how a resume finds it again.
"""
