"""Preference-pair pieces shared by the DPO family and KTO: rows, reference, update, config."""
