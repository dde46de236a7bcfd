"""The API's logic, one module per resource, between the routers (HTTP) and the store and workers.

A service takes a validated request and the principal it acts for, and returns response models or
raises the API's errors (errors.py); it never sees a `Request`. Idempotency lives in
idempotency.py, used by every mutating call.
"""
