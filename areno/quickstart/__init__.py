"""The `quickstart` preset (`areno train --preset quickstart`): see preset.py and task.py."""
