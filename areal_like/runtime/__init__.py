"""Run management shared by the recipes: process group and seeds, weight sync to the fleet,
evaluation, checkpoint/recover, metrics and curves."""
