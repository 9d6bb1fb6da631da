"""Test-side helpers: the no-GPU shims for megatron-core, the GDN harnesses of the tests and
tools, shared inputs. Never imported by the library, and left out of the wheel (pyproject's
package ``exclude``): the checkout's tests, examples and tools import it from the checkout."""
