"""The CLI's commands: glue from a validated Config to the library, one file each."""
