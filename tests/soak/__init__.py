"""The reliability soak: a live server on loopback under a bounded mix of normal and faulty clients.

server.py builds the server (tiny random model, scripted tool calls, operator tools that succeed,
fail and hang), scenarios.py holds the client behaviours, driver.py runs them and checks the end
state, run.py is the command line (`python -m tests.soak.run --help`).
"""
