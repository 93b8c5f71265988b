"""Initial ledger: the whole data contract of DESIGN.md.

Revision ID: 53ef7a0f4282
Revises: 
Create Date: 2026-11-29 08:49:05.896916
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision: str = '53ef7a0f4282'
down_revision: Union[str, None] = None
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table('environment',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.Text(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('spec_hash', sa.Text(), nullable=False),
    sa.Column('spec', postgresql.JSONB(astext_type=sa.Text()), server_default='{}', nullable=False),
    sa.Column('env_version', sa.Text(), nullable=False),
    sa.Column('verifier_version', sa.Text(), nullable=False),
    sa.Column('harness_version', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('deprecated', sa.Boolean(), server_default='false', nullable=False),
    sa.CheckConstraint('version >= 1', name='ck_environment_version_positive'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('name', 'spec_hash', name='uq_environment_name_spec_hash'),
    sa.UniqueConstraint('name', 'version', name='uq_environment_name_version')
    )
    op.create_table('run',
    sa.Column('id', sa.UUID(), nullable=False),
    sa.Column('name', sa.Text(), nullable=False),
    sa.Column('config', postgresql.JSONB(astext_type=sa.Text()), server_default='{}', nullable=False),
    sa.Column('config_hash', sa.Text(), nullable=False),
    sa.Column('status', sa.Text(), server_default='created', nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint("status IN ('created', 'running', 'completed', 'failed')", name='ck_run_status'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('name', name='uq_run_name')
    )
    op.create_table('eval_result',
    sa.Column('id', sa.BigInteger(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.UUID(), nullable=False),
    sa.Column('policy_version', sa.Integer(), nullable=False),
    sa.Column('env_name', sa.Text(), nullable=False),
    sa.Column('env_version', sa.Integer(), nullable=False),
    sa.Column('n_tasks', sa.Integer(), nullable=False),
    sa.Column('n_success', sa.Integer(), nullable=False),
    sa.Column('success_rate', sa.Double(), nullable=False),
    sa.Column('details', postgresql.JSONB(astext_type=sa.Text()), server_default='{}', nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint('n_success >= 0 AND n_success <= n_tasks', name='ck_eval_result_counts'),
    sa.ForeignKeyConstraint(['run_id'], ['run.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('run_id', 'policy_version', 'env_name', 'env_version', name='uq_eval_result_version_env')
    )
    op.create_table('metric',
    sa.Column('id', sa.BigInteger(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.UUID(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('name', sa.Text(), nullable=False),
    sa.Column('value', sa.Double(), nullable=False),
    sa.Column('policy_version', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['run.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('run_id', 'name', 'step', name='uq_metric_run_name_step')
    )
    op.create_table('policy_version',
    sa.Column('run_id', sa.UUID(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('learner_step', sa.Integer(), nullable=False),
    sa.Column('weights_uri', sa.Text(), nullable=False),
    sa.Column('sha256', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('published_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint('version >= 0', name='ck_policy_version_nonnegative'),
    sa.ForeignKeyConstraint(['run_id'], ['run.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'version'),
    sa.UniqueConstraint('run_id', 'learner_step', name='uq_policy_version_run_step')
    )
    op.create_table('rollout_group',
    sa.Column('id', sa.UUID(), nullable=False),
    sa.Column('run_id', sa.UUID(), nullable=False),
    sa.Column('split', sa.Text(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('group_index', sa.Integer(), nullable=False),
    sa.Column('task_id', sa.Text(), nullable=False),
    sa.Column('size', sa.Integer(), nullable=False),
    sa.Column('max_attempts', sa.Integer(), nullable=False),
    sa.Column('state', sa.Text(), server_default='open', nullable=False),
    sa.Column('learner_step', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('completed_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("(state IN ('claimed', 'consumed')) = (learner_step IS NOT NULL)", name='ck_group_learner_step'),
    sa.CheckConstraint("split = 'train' OR learner_step IS NULL", name='ck_group_eval_never_trained'),
    sa.CheckConstraint("split IN ('train', 'eval')", name='ck_group_split'),
    sa.CheckConstraint("state IN ('open', 'complete', 'claimed', 'consumed', 'dropped')", name='ck_group_state'),
    sa.CheckConstraint('size >= 1 AND max_attempts >= 1', name='ck_group_sizes'),
    sa.ForeignKeyConstraint(['run_id'], ['run.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('run_id', 'split', 'step', 'group_index', name='uq_group_coordinates')
    )
    op.create_index('ix_group_run_state', 'rollout_group', ['run_id', 'state'], unique=False)
    op.create_table('checkpoint',
    sa.Column('run_id', sa.UUID(), nullable=False),
    sa.Column('learner_step', sa.Integer(), nullable=False),
    sa.Column('policy_version', sa.Integer(), nullable=False),
    sa.Column('uri', sa.Text(), nullable=False),
    sa.Column('complete', sa.Boolean(), server_default='false', nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.ForeignKeyConstraint(['run_id', 'policy_version'], ['policy_version.run_id', 'policy_version.version'], name='fk_checkpoint_policy_version', ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['run_id'], ['run.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'learner_step')
    )
    op.create_table('slot',
    sa.Column('id', sa.UUID(), nullable=False),
    sa.Column('run_id', sa.UUID(), nullable=False),
    sa.Column('group_id', sa.UUID(), nullable=False),
    sa.Column('split', sa.Text(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('task_id', sa.Text(), nullable=False),
    sa.Column('sample_index', sa.Integer(), nullable=False),
    sa.Column('state', sa.Text(), server_default='pending', nullable=False),
    sa.Column('lease_owner', sa.Text(), nullable=True),
    sa.Column('lease_attempt_id', sa.UUID(), nullable=True),
    sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('infra_failures', sa.Integer(), server_default='0', nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint("(state = 'leased') = (lease_attempt_id IS NOT NULL AND lease_expires_at IS NOT NULL)", name='ck_slot_lease'),
    sa.CheckConstraint("split IN ('train', 'eval')", name='ck_slot_split'),
    sa.CheckConstraint("state IN ('pending', 'leased', 'done', 'abandoned')", name='ck_slot_state'),
    sa.ForeignKeyConstraint(['group_id'], ['rollout_group.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['run_id'], ['run.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('group_id', 'sample_index', name='uq_slot_group_sample')
    )
    op.create_index('ix_slot_claim', 'slot', ['run_id', 'split', 'state', 'step'], unique=False)
    op.create_table('attempt',
    sa.Column('id', sa.UUID(), nullable=False),
    sa.Column('slot_id', sa.UUID(), nullable=False),
    sa.Column('run_id', sa.UUID(), nullable=False),
    sa.Column('worker', sa.Text(), nullable=False),
    sa.Column('status', sa.Text(), server_default='running', nullable=False),
    sa.Column('error_class', sa.Text(), nullable=True),
    sa.Column('error_text', sa.Text(), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('ended_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("status IN ('running', 'ok', 'task_failed', 'infra_failed', 'cancelled')", name='ck_attempt_status'),
    sa.ForeignKeyConstraint(['run_id'], ['run.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['slot_id'], ['slot.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index('ix_attempt_slot', 'attempt', ['slot_id'], unique=False)
    op.create_table('trajectory',
    sa.Column('id', sa.UUID(), nullable=False),
    sa.Column('run_id', sa.UUID(), nullable=False),
    sa.Column('slot_id', sa.UUID(), nullable=False),
    sa.Column('attempt_id', sa.UUID(), nullable=False),
    sa.Column('group_id', sa.UUID(), nullable=False),
    sa.Column('task_id', sa.Text(), nullable=False),
    sa.Column('split', sa.Text(), nullable=False),
    sa.Column('env_name', sa.Text(), nullable=False),
    sa.Column('env_version', sa.Integer(), nullable=False),
    sa.Column('verifier_version', sa.Text(), nullable=False),
    sa.Column('harness_version', sa.Text(), nullable=False),
    sa.Column('reward', sa.Double(), nullable=False),
    sa.Column('terminated', sa.Boolean(), nullable=False),
    sa.Column('truncated', sa.Boolean(), nullable=False),
    sa.Column('failure_type', sa.Text(), nullable=True),
    sa.Column('policy_version_min', sa.Integer(), nullable=False),
    sa.Column('policy_version_max', sa.Integer(), nullable=False),
    sa.Column('timings', postgresql.JSONB(astext_type=sa.Text()), server_default='{}', nullable=False),
    sa.Column('info', postgresql.JSONB(astext_type=sa.Text()), server_default='{}', nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint("failure_type IS NULL OR failure_type IN ('task_failed', 'truncated')", name='ck_trajectory_failure_type'),
    sa.CheckConstraint("split IN ('train', 'eval')", name='ck_trajectory_split'),
    sa.CheckConstraint('NOT (terminated AND truncated)', name='ck_trajectory_end'),
    sa.CheckConstraint('policy_version_min <= policy_version_max', name='ck_trajectory_versions'),
    sa.ForeignKeyConstraint(['attempt_id'], ['attempt.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['group_id'], ['rollout_group.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['run_id'], ['run.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['slot_id'], ['slot.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('attempt_id', name='uq_trajectory_attempt'),
    sa.UniqueConstraint('run_id', 'id', 'split', name='uq_trajectory_run_id_split'),
    sa.UniqueConstraint('slot_id', name='uq_trajectory_slot')
    )
    op.create_index('ix_trajectory_group', 'trajectory', ['group_id'], unique=False)
    op.create_table('consumption',
    sa.Column('run_id', sa.UUID(), nullable=False),
    sa.Column('trajectory_id', sa.UUID(), nullable=False),
    sa.Column('split', sa.Text(), server_default='train', nullable=False),
    sa.Column('learner_step', sa.Integer(), nullable=False),
    sa.Column('policy_version', sa.Integer(), nullable=False),
    sa.Column('version_lag', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint("split = 'train'", name='ck_consumption_train_only'),
    sa.ForeignKeyConstraint(['run_id', 'trajectory_id', 'split'], ['trajectory.run_id', 'trajectory.id', 'trajectory.split'], name='fk_consumption_trajectory', ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['run_id'], ['run.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'trajectory_id')
    )
    op.create_index('ix_consumption_step', 'consumption', ['run_id', 'learner_step'], unique=False)
    op.create_table('segment',
    sa.Column('trajectory_id', sa.UUID(), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('request_id', sa.Text(), nullable=False),
    sa.Column('policy_version', sa.Integer(), nullable=False),
    sa.Column('version_spans', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('tokenizer_version', sa.Text(), nullable=False),
    sa.Column('prompt_ids', postgresql.ARRAY(sa.Integer()), nullable=False),
    sa.Column('generated_ids', postgresql.ARRAY(sa.Integer()), nullable=False),
    sa.Column('action_loss_mask', postgresql.ARRAY(sa.SmallInteger()), nullable=False),
    sa.Column('rollout_logprobs', postgresql.ARRAY(sa.Double()), nullable=False),
    sa.Column('logprob_semantics', sa.Text(), nullable=False),
    sa.Column('sampling_config', postgresql.JSONB(astext_type=sa.Text()), server_default='{}', nullable=False),
    sa.Column('tool_events', postgresql.JSONB(astext_type=sa.Text()), server_default='[]', nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('ended_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint('cardinality(generated_ids) = cardinality(action_loss_mask) AND cardinality(generated_ids) = cardinality(rollout_logprobs)', name='ck_segment_lengths'),
    sa.ForeignKeyConstraint(['trajectory_id'], ['trajectory.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('trajectory_id', 'seq')
    )


def downgrade() -> None:
    op.drop_table('segment')
    op.drop_index('ix_consumption_step', table_name='consumption')
    op.drop_table('consumption')
    op.drop_index('ix_trajectory_group', table_name='trajectory')
    op.drop_table('trajectory')
    op.drop_index('ix_attempt_slot', table_name='attempt')
    op.drop_table('attempt')
    op.drop_index('ix_slot_claim', table_name='slot')
    op.drop_table('slot')
    op.drop_table('checkpoint')
    op.drop_index('ix_group_run_state', table_name='rollout_group')
    op.drop_table('rollout_group')
    op.drop_table('policy_version')
    op.drop_table('metric')
    op.drop_table('eval_result')
    op.drop_table('run')
    op.drop_table('environment')
