"""The workshop's small promises: text a student reads is clean, outputs are checked first."""
from minipar import data


def test_decode_leaves_out_a_cut_multibyte_character_instead_of_u_fffd():
    tok = data.ByteTokenizer()
    ids = tok.encode("déjà vu €").tolist()
    assert tok.decode(ids) == "déjà vu €"
    assert tok.decode(ids[:-1]) == "déjà vu "          # the euro sign's last byte missing
    assert tok.decode(ids[:1] + [0xFF] + ids[1:]) == "déjà vu €"   # a byte that starts nothing
    assert "\ufffd" not in tok.decode(ids[:-2] + ids[:-1])
