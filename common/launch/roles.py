"""The roles a pdserve process can run and the module (`python -m ...`) that runs each."""

from typing import Final

ROLE_MODULES: Final = {
    "prefill": "prefill_node",
    "decode": "decode_node",
    "bootstrap": "bootstrap",
    "colocated": "colocated_node",
}
