"""Which methods are registered, written by ``python -m rankwise.readme`` (do not edit by hand).

``REGISTERED`` maps every registered id to the module that calls :func:`rankwise.core.registry.register`.
The registry answers ``status``/``table`` (``rankwise list``, the README table) from here, so that
listing the papers imports no method module (and no torch); ``tests/test_registry.py`` checks that it
equals what importing every method module registers.
"""

from __future__ import annotations

REGISTERED: dict[str, str] = {
    'agentvocab': 'rankwise.infer.agentvocab',
    'arpc': 'rankwise.science.arpc.codec',
    'cdka': 'rankwise.adapt.cdka.model',
    'condiquant': 'rankwise.compress.condiquant',
    'ctm': 'rankwise.merge.ctm',
    'daf': 'rankwise.adapt.daf.model',
    'diffbcp': 'rankwise.science.diffbcp.method',
    'distill_multiindex': 'rankwise.science.distill_multiindex',
    'e2lora': 'rankwise.adapt.e2lora.model',
    'fslora': 'rankwise.federated.fslora',
    'gfwsvd': 'rankwise.compress.gfwsvd',
    'heapr': 'rankwise.compress.heapr',
    'intrinsic_dynamics': 'rankwise.science.intrinsic_dynamics',
    'lopti': 'rankwise.train.lopti',
    'lora': 'rankwise.adapt.lora.model',
    'lora_mixer': 'rankwise.adapt.lora_mixer.model',
    'mi_sprm': 'rankwise.science.mi_sprm.matrix',
    'mtlora': 'rankwise.adapt.mtlora.model',
    'p2d': 'rankwise.train.p2d.method',
    'pave': 'rankwise.science.pave.method',
    'priorguide': 'rankwise.science.priorguide.sampling',
    'psoft': 'rankwise.adapt.psoft.model',
    'racs_alice': 'rankwise.train.racs_alice',
    'rank_clustering': 'rankwise.science.rank_clustering.algorithm',
    'ranktuner': 'rankwise.train.ranktuner',
    'riemannian_lora': 'rankwise.train.riemannian_lora',
    'root_purge': 'rankwise.science.root_purge',
    'saes_svd': 'rankwise.compress.saes_svd',
    'safety_one_shot': 'rankwise.train.safety_one_shot',
    'sambal': 'rankwise.science.sambal.relex',
    'santa': 'rankwise.infer.santa',
    'star_kv': 'rankwise.compress.star_kv',
    'stiefel_cl': 'rankwise.adapt.stiefel_cl.model',
    'swift_svd': 'rankwise.compress.swift_svd',
    'token_dynamics': 'rankwise.science.token_dynamics',
    'ub_smoe': 'rankwise.federated.ub_smoe',
    'uldnet': 'rankwise.science.uldnet.model',
    'vapt': 'rankwise.adapt.vapt.model',
    'winq': 'rankwise.train.qat.winq',
}
