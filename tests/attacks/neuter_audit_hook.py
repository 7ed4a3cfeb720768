# Prelude of the hook_* attacks: make the sandbox's audit hook (PEP 578) a no-op. A hook cannot be
# removed, but the helper it calls to refuse an event can be rewritten: the garbage collector
# reaches that function, and the hook guards only itself against having its code swapped.
import gc


def _neuter_audit_hook() -> bool:
    allow = (lambda *args, **kwargs: None).__code__
    swapped = False
    for obj in gc.get_objects():
        if type(obj).__name__ == "function" and obj.__name__ == "refuse" \
                and obj.__code__.co_filename.endswith("child.py"):
            obj.__code__ = allow
            swapped = True
    return swapped


HOOK_NEUTERED = _neuter_audit_hook()
