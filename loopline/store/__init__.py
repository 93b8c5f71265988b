"""The ledger: tables, connection, migrations and the operations that keep runs exactly-once."""
