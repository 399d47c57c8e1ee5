//! The step rules a push is checked against before it is applied
//! (`docs/contract.md`, step semantics), and the refusals they answer.

use super::error::EngineError;
use super::rank::{self, PushOutcome, RankState};
use super::FinishedAt;
use crate::run::RunConfig;
use crate::wire::ParsedPush;

/// What a trainer that restarted from a checkpoint should do, for the
/// `step_conflict` answers: a restart without `resume` is the usual cause.
fn resume_hint(run: &str, last: u64) -> String {
    format!(
        "a trainer restarted from a checkpoint first restores the EMA with `run.resume(S)` \
         (POST /v1/runs/{run}/resume {{\"step\": S}}, S = the last step the checkpoint pushed), \
         then pushes S + 1 onward; otherwise push steps after {last}"
    )
}

/// The refusal of a push past the step a run was finished at.
pub(super) fn finished_error(run: &str, FinishedAt(last): FinishedAt) -> EngineError {
    let at = last.map_or("before any push".to_string(), |l| format!("at step {l}"));
    EngineError::RunFinished(format!(
        "run `{run}` was finished {at}; it takes no more pushes (create a new run to train on)"
    ))
}

/// Step rules (`docs/contract.md`, step semantics) for a rank that pushed
/// before: an older step is refused, the last step again is a duplicate
/// (answered without applying) when its bytes are the same and refused
/// otherwise. `None`: apply it.
pub(super) fn step_rules(
    run: &str,
    rank: u32,
    step: u64,
    state: &RankState,
    push: &ParsedPush,
    config: &RunConfig,
) -> Result<Option<PushOutcome>, EngineError> {
    let Some(last) = state.last_step else {
        return Ok(None);
    };
    // A pipelined push applied, its answer lost, retried after its
    // successor was applied: the same bytes are a duplicate.
    let seen_before = step < last
        && state
            .recent
            .iter()
            .any(|&(s, d)| s == step && d.matches(push.digest, &push.body));
    if seen_before {
        return Ok(Some(duplicate(step, last, state, config)));
    }
    if step < last {
        return Err(EngineError::StepConflict(format!(
            "step {step} is older than rank {rank}'s last applied step {last}; {}",
            resume_hint(run, last)
        )));
    }
    if step > last {
        return Ok(None);
    }
    if state
        .last_digest
        .is_some_and(|d| d.matches(push.digest, &push.body))
    {
        return Ok(Some(duplicate(step, last, state, config)));
    }
    Err(EngineError::StepConflict(format!(
        "step {step} was already applied for rank {rank} with other bytes; {}",
        resume_hint(run, last)
    )))
}

/// The answer to a push whose bytes were already applied at `step`.
fn duplicate(step: u64, last: u64, state: &RankState, config: &RunConfig) -> PushOutcome {
    PushOutcome {
        applied: false,
        duplicate: true,
        step,
        last_step: Some(last),
        skipped: Vec::new(),
        registered: None,
        resident_bytes: state.resident_bytes(config),
        apply_seconds: 0.0,
        drift: None,
        logical_bytes: 0,
        mirror_mismatch: None,
    }
}

/// A delta or XOR push needs a mirror and a keyframe to apply to.
pub(super) fn check_relative(
    push: &ParsedPush,
    config: &RunConfig,
    rank: u32,
    state: Option<&RankState>,
) -> Result<(), EngineError> {
    if !push.kind.is_relative() {
        return Ok(());
    }
    if !config.mirror {
        return Err(EngineError::NeedsKeyframe(
            "needs keyframe: delta and xor pushes need a run created with `mirror: true`".into(),
        ));
    }
    if !state.is_some_and(|s| s.has_keyframe) {
        return Err(EngineError::NeedsKeyframe(format!(
            "needs keyframe: rank {rank} has no full push to add a delta to (none yet, or the rank was taken over from a lost node and its mirror may be behind the trainer's)"
        )));
    }
    Ok(())
}

/// A keyframe checks the client's idea of the mirror against the mirror,
/// before it overwrites (and so repairs) it.
pub(super) fn mirror_mismatch(
    push: &ParsedPush,
    state: &RankState,
    order: &[usize],
) -> Result<Option<rank::MirrorMismatch>, EngineError> {
    match push.mirror_crc32 {
        Some(claimed)
            if push.kind == crate::wire::PushKind::Full
                && state.has_keyframe
                && state.mirror.is_some() =>
        {
            let found = state.mirror_crc32(order)?;
            Ok((found != claimed).then_some(rank::MirrorMismatch {
                client_crc32: format!("{claimed:08x}"),
                server_crc32: format!("{found:08x}"),
            }))
        }
        _ => Ok(None),
    }
}
