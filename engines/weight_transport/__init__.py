"""Weight transport by process group: the trainer's end (process_group_trainer) and the
fleet's end (process_group_fleet). Disk and adapter loads are `ServerAPI.load_weights`."""
