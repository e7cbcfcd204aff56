"""Alembic environment and versions for Conveyor's SQL schema (see `gateway.db.upgrade`)."""
