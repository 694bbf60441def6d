package metapb

// Reasons in the google.rpc.ErrorInfo detail of namespace errors (domain
// ReasonDomain), so that clients and gateways tell what failed without
// parsing messages: a NotFound says which resource is missing. Hand
// written: not generated from proto/meta.
const (
	ReasonDomain = "namespace.basalt"

	ReasonNoSuchVolume = "NO_SUCH_VOLUME"
	ReasonNoSuchBucket = "NO_SUCH_BUCKET"
	ReasonNoSuchKey    = "NO_SUCH_KEY"
	ReasonNoSuchUpload = "NO_SUCH_UPLOAD"

	ReasonInvalidPart      = "INVALID_PART"
	ReasonInvalidPartOrder = "INVALID_PART_ORDER"
	ReasonEntityTooSmall   = "ENTITY_TOO_SMALL"
	ReasonVersionChanged   = "VERSION_CHANGED"
	ReasonNotShareable     = "NOT_SHAREABLE" // CopyKey cannot share the blocks; copy the bytes

	// ReasonNotApplied marks an UNAVAILABLE that the server guarantees had
	// no effect (the request was refused before it reached a Raft log), so
	// any call may be sent again. (A NotLeader detail means the same.)
	ReasonNotApplied = "NOT_APPLIED"
	// ReasonOutcomeUnknown marks an UNKNOWN whose operation reached the
	// Raft log and may or may not have been applied (the proposal's
	// outcome was lost: leadership change, timeout, node stopping). A
	// caller must read the state back before doing it again.
	ReasonOutcomeUnknown = "OUTCOME_UNKNOWN"
)

// ReasonPreconditionFailed marks a FAILED_PRECONDITION of a write whose
// KeyPrecondition did not hold when it was applied.
const ReasonPreconditionFailed = "PRECONDITION_FAILED"
